"""The compiled kernels: which route makes them (:mod:`.route`), the pip run that installs the tree with
them (:mod:`.pip`), the one target every kernels tarball is checked against (:mod:`.target`), and the list
of this tree's kernels a tarball must hold (:mod:`.expected`)."""
