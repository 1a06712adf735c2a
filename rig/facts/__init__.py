"""The facts layer: what the rig reads once: the variables (``config``, one table), the profiles, the series, the
build record, the kernels' record."""
