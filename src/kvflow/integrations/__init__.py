"""Adapters that plug kvflow into serving engines.

Each engine's adapter is its own module (``kvflow.integrations.vllm``) and is the only place that
imports that engine: importing ``kvflow`` or this package never imports an engine.
"""
