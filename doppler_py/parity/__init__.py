"""Support for comparing doppler-py with the JS original (npm doppler-gpu): fetching it, verified."""
