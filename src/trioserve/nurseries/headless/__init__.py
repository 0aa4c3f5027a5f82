"""Headless engines: engine cores on a host without a front-end, joining one on another host over TCP."""
