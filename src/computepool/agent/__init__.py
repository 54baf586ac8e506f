"""The node agent's local building blocks: devices, executor, isolation, local state.

Everything here works without the control plane, so a node keeps running its workloads when
the server is away and can report what happened when it comes back.
"""
