"""The worker plane: the ZeroMQ edge (zmq_io, its ZAP handler), the workers this gateway knows
(handle, registry) and where a request goes (prefix, routing). Imports only the gateway's base
and common/."""
