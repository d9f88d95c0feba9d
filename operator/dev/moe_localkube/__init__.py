"""Dev/test infrastructure, not product: a real Kubernetes v1.20.2 control plane on loopback
(``controlplane``) and a node agent that plays the kubelet for fake GPU nodes (``nodeagent``).
See docs/localkube.md."""
