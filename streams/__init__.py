"""faust-streaming agents, one per pipeline stage (see ``streams.app.create_app``).

Agents stay thin: decode at the edge, run the stage function (``jobstream.stages``) in a worker
thread, route failures explicitly (dead-letter topic, in-place retry). Offsets are committed by
completion per partition (``streams.offsets``), never past a message still in flight: the offset
commit always follows the stage's Postgres transaction.
"""
