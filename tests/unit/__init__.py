"""Unit tests, one folder per package of src/asyncrl; shared helpers in helpers/."""
