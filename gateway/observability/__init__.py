"""What the gateway counts and shows: Prometheus metrics (and a tier's shared view), request
traces, the event loop's lag. Reads the core through small Protocols, never imports it."""
