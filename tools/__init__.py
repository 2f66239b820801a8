"""Tools that are neither the mesh nor its benchmarks."""
