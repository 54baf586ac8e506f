"""The coop controller: measures, plans and places cooperative services (leader-only)."""
