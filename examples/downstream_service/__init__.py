"""A complete downstream service built on the consumer library: charges a ledger once per
``job.ready`` (see README.md in this folder)."""
