"""Tools: the `eb` command (`cli`) and the side-by-side benchmarks (`bench`)."""
