"""Megatron-Core side of RollVerify: conversion, log-probs, routing replay, train step, weight export."""
