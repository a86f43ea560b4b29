"""``kvflow bench``: the multi-round QA workload on the reference engine, offload off vs on."""
