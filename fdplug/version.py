"""fdplug's version, in a module of its own: what reports it (the servers' ``/version``) need not
import the package's facade (`fdplug`)."""

__version__ = "0.1.0"
