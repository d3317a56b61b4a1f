"""Target against reference: the differential replay (`differential`), one op judged alone from
the same inputs (`opcheck`), dtype-aware comparison (`compare`) and reference implementations
of device-only ops (`kernels`)."""
