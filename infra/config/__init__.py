"""Settings and the closed sets of names a user chooses from (`choices`)."""
