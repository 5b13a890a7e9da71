"""The pages a browser opens: the web chat page (GET /, /ui/) and the API docs (/docs, /redoc)."""
