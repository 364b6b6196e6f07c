"""Getting ready to speculate: pipelines compiled ahead of use, and verification costs measured once per
device and model and kept on disk."""
