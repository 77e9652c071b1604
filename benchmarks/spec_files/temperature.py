import argparse
import sys


def celsius_to_fahrenheit(celsius: float) -> float:
    return celsius * 9 / 5 + 32


def fahrenheit_to_celsius(fahrenheit: float) -> float:
    return (fahrenheit - 32) * 5 / 9


def celsius_to_kelvin(celsius: float) -> float:
    return celsius + 273.15


def convert(value: float, unit: str) -> str:
    if unit == "c":
        return f"{value:.1f} C = {celsius_to_fahrenheit(value):.1f} F"
    if unit == "f":
        return f"{value:.1f} F = {fahrenheit_to_celsius(value):.1f} C"
    if unit == "k":
        return f"{value:.1f} C = {celsius_to_kelvin(value):.1f} K"
    raise ValueError(f"unknown unit: {unit}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Convert temperatures.")
    parser.add_argument("value", type=float, help="the temperature to convert")
    parser.add_argument("--unit", choices=["c", "f", "k"], default="c",
                        help="the unit of the value")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        print(convert(args.value, args.unit))
    except ValueError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
