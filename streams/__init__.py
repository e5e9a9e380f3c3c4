"""faust-streaming agents, one per pipeline stage (see ``streams.app.create_app``).

Agents stay thin: decode at the edge, run the stage function (``jobstream.stages``) in a worker
thread, route failures explicitly (dead-letter topic, in-place retry). faust acks an event when
the agent takes the next one, and commits acked offsets afterwards: the offset commit always
follows the stage's Postgres transaction.
"""
