"""The base layer: the standard library with a name: errors and the one voice (``console``), atomic writes, hashes,
processes, git as a program."""
