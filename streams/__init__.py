"""The pipeline's stages and their faust agents (see ``streams.app.create_app``).

One module per stage (``intake``, ``extract``, ``chunk``, ``llm``, ``validate``, ``publish``;
their order, names and topics are ``schemas.pipeline.PIPELINE``), each holding its body
(``work``) and its agent registration; ``runner`` is the claim/complete protocol every stage
after intake runs, ``actions`` the operator actions (redrive, reconcile, give_up, sweep),
``context`` what stage code shares. Agents stay thin: decode at the edge, run the stage in a
worker thread, route failures explicitly (``base``: dead-letter topic, retry topic). Offsets are
committed by completion per partition (``streams.offsets``), never past a message still in
flight: the offset commit always follows the stage's Postgres transaction.
"""
