"""A3B weight quantization: format, baselines, calibration, converter and quality report."""
