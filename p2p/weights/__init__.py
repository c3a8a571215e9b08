"""Weight distribution: signed sharded manifests, a versioned on-disk store, relays and verified multi-source fetch."""
