"""Byte and message transports between processes: length-prefixed msgspec
frames on a socketpair (engine core <-> worker) and ZeroMQ sockets driven
natively from Trio (front-end <-> engine core). No actors here: each
transport is owned by exactly one task of the layer above."""
