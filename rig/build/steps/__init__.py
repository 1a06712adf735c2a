"""The eight build steps and the pipeline that runs them."""
