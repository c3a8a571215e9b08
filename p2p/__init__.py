"""Networking: Ed25519 identity and signing, DHT membership, weight distribution, bulk transfer."""
