"""The HTTP routes, one module per family; each has `add_routes(app, api)`."""
