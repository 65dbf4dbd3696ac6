"""a3b-triton: serving logic behind the Triton model repository."""
