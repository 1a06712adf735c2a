"""The compiled kernels: which route makes them (:mod:`.route`), the pip run that installs the tree with
them (:mod:`.pip`), and the one target every kernels tarball is checked against (:mod:`.target`)."""
