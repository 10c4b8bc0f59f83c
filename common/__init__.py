"""Code shared by the ortfleet gateway and workers: settings, wire formats, Redis layout."""
