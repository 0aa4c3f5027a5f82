"""Engine cores placed by Ray: the local cluster's supervised head, and the actor an engine core runs under."""
