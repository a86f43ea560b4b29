"""Disaggregated serving on the reference engine: the router that sends a request to a prefill
engine (P) and a decode engine (D), and the engine processes it starts."""
