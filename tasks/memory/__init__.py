"""Device memory per stage, known before launch: fake models stepped under torch's tracker."""
