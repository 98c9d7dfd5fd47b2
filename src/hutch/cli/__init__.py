"""The hutch command line."""
