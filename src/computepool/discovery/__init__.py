"""LAN discovery of the pool's nodes: signed announcements over mDNS/DNS-SD (python-zeroconf) or
unicast UDP, verified against the pool's discovery key, and link probes between verified peers."""
