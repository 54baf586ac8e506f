"""The logic behind the routes: authorize against the object, change the store, audit. No HTTP here."""
