"""Engine replicas on Ray Serve behind one ingress (issue 12 item 1, 3). Imported only by
``coda serve --replicas N``; ``ray[serve]`` is the optional ``scale`` extra."""
