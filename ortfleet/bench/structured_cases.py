"""The cases of `ortfleet bench structured`: ten pydantic models with a prompt each, ten `json_object`
prompts, and tools with prompts that call them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class City(BaseModel):
    name: str
    country: str
    population_millions: float


class Person(BaseModel):
    name: str
    age: int
    occupation: str


class Book(BaseModel):
    title: str
    author: str
    year: int


class Recipe(BaseModel):
    dish: str
    ingredients: list[str]
    minutes: int


class Weather(BaseModel):
    city: str
    temperature_celsius: float
    sunny: bool


class Product(BaseModel):
    name: str
    price_usd: float
    in_stock: bool


class Movie(BaseModel):
    title: str
    year: int
    genre: str


class Animal(BaseModel):
    species: str
    legs: int
    can_fly: bool


class Planet(BaseModel):
    name: str
    moons: int
    has_rings: bool


class Meeting(BaseModel):
    topic: str
    day: str
    attendees: list[str]


PARSE_CASES: list[tuple[type[BaseModel], str]] = [
    (City, "Describe Paris as JSON."),
    (Person, "Invent a person who works in a bakery and describe them."),
    (Book, "Tell me about the novel Moby-Dick."),
    (Recipe, "Give me a simple pancake recipe."),
    (Weather, "What is the weather like in Madrid on a summer afternoon?"),
    (Product, "Describe a cheap umbrella sold in a shop."),
    (Movie, "Tell me about the film Casablanca."),
    (Animal, "Describe a spider."),
    (Planet, "Describe the planet Saturn."),
    (Meeting, "Plan a team meeting about the budget on Monday with Ann and Bob."),
]
OBJECT_PROMPTS = [
    "Describe a cat as a JSON object.",
    "Give a JSON object with the name and capital of France.",
    "Return a JSON object describing a red car.",
    "Describe your favourite fruit in JSON.",
    "Give the days of a weekend as a JSON object.",
    "Write a JSON object about a dog called Rex.",
    "Describe the sun in a JSON object.",
    "Give a JSON object with a greeting in English and in Spanish.",
    "Describe a bicycle as JSON.",
    "Return a JSON object for a book with its title and author.",
]


class WeatherArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str
    unit: Literal["celsius", "fahrenheit"] | None = None


class SearchArguments(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str
    limit: int | None = Field(None, ge=1, le=10)


# Two tools whose shortest call is a little under 24 tokens on the default model (ortfleet's call syntax
# takes 18 of them), each with a required string and an optional bounded field.
TOOL_ARGUMENTS: dict[str, type[BaseModel]] = {"weather": WeatherArguments, "search": SearchArguments}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": model.model_json_schema()},
    }
    for (name, model), description in zip(
        TOOL_ARGUMENTS.items(), ("The weather in a city.", "Search the web."), strict=True
    )
]
# Each prompt once with the tool named in tool_choice and once with tool_choice "required".
TOOL_CASES: list[tuple[str, str]] = [
    ("weather", "What is the weather like in Lisbon today?"),
    ("search", "Find the opening hours of the Louvre museum in Paris."),
    ("weather", "Will it rain in Tokyo tomorrow afternoon?"),
    ("search", "Look up the population of Canada."),
    ("weather", "Is it cold in Oslo this week?"),
]
