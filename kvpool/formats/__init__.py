"""File formats read without heavy dependencies."""
