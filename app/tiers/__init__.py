"""Storage tiers: each a small module behind a narrow interface (see ``base``)."""
