"""Serving: the request protocol, the HTTP server and the batch runner."""
