"""The worker-side runtime on an event loop (anyio on asyncio): clock, reactor, DMA executor,
the worker runtime and its synchronous facade. Time is read only through an injected ``Clock``."""
