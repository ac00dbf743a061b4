"""Small shared utilities: multi-rank launch (`distributed`) and atomic directories (`atomic`)."""
