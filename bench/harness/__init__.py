"""The benchmarks' shared harness: machine facts, recording, peers, slow links, the cluster."""
