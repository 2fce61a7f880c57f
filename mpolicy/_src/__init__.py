"""Private implementation of mpolicy. Import from `mpolicy`, not from here."""
