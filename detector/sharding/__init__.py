"""N detector replicas, each judging its own share of the fleet: who owns what (``shard``), the shard's view of a
source (``shard_source``: one cheap job map, then per-node queries for its own nodes), the job map kept across
evaluations (``job_map``) and the folding of per-node queries into fewer requests (``fold``). Imports the frame,
``sources`` and ``core``; never a rule."""
