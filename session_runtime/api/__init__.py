"""The HTTP edge: a thin FastAPI shell over Runtime."""
