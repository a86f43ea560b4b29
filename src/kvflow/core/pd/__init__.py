"""Prefill → decode (PD) hand-off, sans-IO: messages, the producer's and consumer's state machines
(tables) and their managers. The control plane (runtime) and transports (backends) carry out what
the managers return."""
