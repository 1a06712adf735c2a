"""The build layer: the eight steps, the kernel target and routes, the tree in scratch, pack and verify, the
container's verify, the image build (``nox -s image``)."""
