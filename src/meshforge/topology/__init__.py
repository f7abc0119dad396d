"""What exists on the server: subjects, streams and consumers, provisioning, partitions, permissions."""
