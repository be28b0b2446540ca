"""Data: built-in tasks and chat datasets on disk."""
