from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 0


@dataclass
class Inventory:
    items: dict[str, Item] = field(default_factory=dict)

    def add(self, name: str, price: float, quantity: int = 1) -> None:
        if name in self.items:
            self.items[name].quantity += quantity
        else:
            self.items[name] = Item(name, price, quantity)

    def remove(self, name: str, quantity: int = 1) -> None:
        item = self.items[name]
        if quantity > item.quantity:
            raise ValueError(f"only {item.quantity} of {name} left")
        item.quantity -= quantity
        if item.quantity == 0:
            del self.items[name]

    def total_value(self) -> float:
        return sum(item.price * item.quantity for item in self.items.values())

    def low_stock(self, limit: int = 5) -> list[str]:
        return [item.name for item in self.items.values() if item.quantity < limit]


def main() -> None:
    inventory = Inventory()
    inventory.add("apple", 0.5, 40)
    inventory.add("pear", 0.75, 3)
    inventory.remove("apple", 10)
    print(f"total value: {inventory.total_value():.2f}")
    print("low stock:", ", ".join(inventory.low_stock()))


if __name__ == "__main__":
    main()
