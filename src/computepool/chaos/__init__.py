"""A chaos run: a real pool (server replicas on PostgreSQL, root agents), a random workload, faults
injected at random, and an oracle that checks what the API acknowledged against what happened."""
