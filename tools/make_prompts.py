#!/usr/bin/env python
"""Regenerate ``megatron_rlhf/data/prompts.jsonl`` from the hand-written lists below.

  python tools/make_prompts.py [--output PATH]

Every prompt here was written for this project. Ids follow category order, so append new
prompts at the end of a category's list only if you accept that later ids shift; adding a
new category at the end of ``CATEGORIES`` keeps all existing ids. Within each category
every 10th prompt (positions 10, 20, ...) is held out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELDOUT_EVERY = 10

EXPLANATION = [
    "Why is the sky blue during the day but red at sunset?",
    "Explain photosynthesis in simple terms.",
    "How do vaccines help the body fight disease?",
    "Explain how the water cycle works, from evaporation to rain.",
    "Why do we have seasons on Earth?",
    "What causes ocean tides? Keep the explanation short.",
    "Explain to a ten-year-old why ice floats on water.",
    "How does a rainbow form after a rain shower?",
    "What is gravity, and why do objects fall toward the ground?",
    "Explain the greenhouse effect in a few sentences.",
    "Why does a metal spoon feel colder than a wooden spoon at the same temperature?",
    "How do plants pull water up from their roots to their leaves?",
    "Explain what an atom is to someone with no science background.",
    "Why do we hear thunder after we see lightning?",
    "How does the heart pump blood around the body?",
    "What makes a volcano erupt? Give a short explanation.",
    "Explain how a magnet attracts a piece of iron.",
    "Why does bread rise when yeast is added to the dough?",
    "How do bees turn flower nectar into honey?",
    "What is static electricity, and why does a balloon stick to a wall after you rub it on your hair?",
    "Explain why the Moon seems to change shape during the month.",
    "How do earthquakes happen? Explain it simply.",
    "Why do leaves change color in autumn?",
    "Explain how sound travels through the air to our ears.",
    "What does the stomach do during digestion?",
    "Why does salt help melt ice on roads in winter?",
    "Explain in simple words what DNA is.",
    "How does a refrigerator keep food cold?",
    "Why do stars seem to twinkle at night?",
    "Explain what friction is and give an everyday example.",
    "How do birds stay in the air when they fly?",
    "Why do people need sleep? Give a simple explanation.",
    "Explain how a simple electric circuit lights a bulb.",
    "What is a food chain? Explain it with one example.",
    "Why can a heavy boat made of steel float on water?",
    "How does the human body cool itself down on a hot day?",
    "Explain what evaporation is and why puddles disappear after rain.",
    "Why is the ocean salty while most rivers are not?",
    "How do solar panels turn sunlight into electricity?",
    "What is a black hole? Explain it briefly for a beginner.",
]

MATH = [
    "Sara has 12 apples. She gives 5 to her friend and buys 3 more. How many apples does she have now?",
    "A pencil costs 2 dollars and a notebook costs 4 dollars. How much do 3 pencils and 2 notebooks cost?",
    "A train travels 60 kilometers in one hour. How far does it travel in 3 hours at the same speed?",
    "There are 24 students in a class. They split into groups of 4. How many groups are there?",
    "Tom read 15 pages on Monday and twice as many on Tuesday. How many pages did he read in total?",
    "A rectangle is 7 centimeters long and 3 centimeters wide. What is its area?",
    "Maria bakes 36 cookies and puts them equally into 6 boxes. How many cookies go in each box?",
    "A shirt costs 20 dollars and is on sale for 25% off. What is the sale price?",
    "A recipe needs 2 eggs to make 4 pancakes. How many eggs are needed for 12 pancakes?",
    "Jake is 8 years old. His sister is 3 years older than him. How old will his sister be in 5 years?",
    "A garden has 5 rows of tomato plants with 6 plants in each row. How many tomato plants are there?",
    "What is the perimeter of a square with sides of 9 meters?",
    "A bus has 40 seats and 27 people are sitting on it. How many seats are empty?",
    "Lena saves 5 dollars every week. How many weeks does she need to save 45 dollars?",
    "A pizza is cut into 8 slices. Ana eats 3 slices and Ben eats 2. What fraction of the pizza is left?",
    "A movie starts at 6:45 pm and lasts 1 hour and 50 minutes. What time does it end?",
    "A bag holds 3 red marbles and 7 blue marbles. What fraction of the marbles are red?",
    "A farmer has 18 chickens and 7 cows. How many legs do the animals have in total?",
    "Sam runs 2 kilometers every morning. How many kilometers does he run in two weeks?",
    "A book costs 12 dollars. How much change do you get if you pay with a 50-dollar bill?",
    "The temperature was 4 degrees in the morning and dropped by 9 degrees at night. "
    "What was the temperature at night?",
    "A box holds 6 eggs. How many boxes are needed to pack 40 eggs?",
    "What is the average of 4, 8, 10 and 14? Show how you got it.",
    "Emma has 3 times as many stickers as Leo. Leo has 7 stickers. How many stickers do they have together?",
    "A car uses 6 liters of fuel for every 100 kilometers. How much fuel does it need for 250 kilometers?",
    "A class of 30 students has 18 girls. What percentage of the class are boys?",
    "A water tank holds 100 liters and fills at 4 liters per minute. How long does it take to fill the empty tank?",
    "Noah buys 4 bottles of juice at 3 dollars each and pays with a 20-dollar bill. How much change does he get?",
    "A triangle has two angles of 50 degrees and 60 degrees. What is the third angle?",
    "If 5 workers can paint a fence in 4 hours, how long would 10 workers take at the same rate?",
    "A store sells 3 oranges for 1 dollar. How much do 15 oranges cost?",
    "Mia walks 3 blocks north and then 4 blocks east. How many blocks did she walk in total?",
    "A number is doubled and then 6 is added, giving 20. What is the number?",
    "A library has 120 books and one third of them are novels. How many books are not novels?",
    "Lucas is twice as old as his brother. Together they are 18 years old. How old is Lucas?",
    "A phone plan costs 15 dollars per month. How much does it cost for a whole year?",
    "A cake recipe uses 250 grams of flour. How much flour is needed for 3 cakes?",
    "It takes Zoe 10 minutes to walk to school. If she leaves home at 7:55, what time does she arrive?",
    "A ribbon is 2 meters long. How many pieces of 25 centimeters can be cut from it?",
    "Solve for x: 3x + 5 = 17. Show your steps.",
]

CODING = [
    "Write a Python function that returns the factorial of a non-negative integer n.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case.",
    "Write a Python function that returns the largest number in a list without using max().",
    "How do I reverse a list in Python? Show two different ways.",
    "Write a Python function that counts the vowels in a string.",
    'Write a Python program that prints the numbers from 1 to 20, but prints "Fizz" for multiples '
    'of 3 and "Buzz" for multiples of 5.',
    "Write a Python function that returns the first n Fibonacci numbers as a list.",
    "How can I read a text file line by line in Python?",
    "Write a Python function that removes duplicates from a list while keeping the original order.",
    "Explain what a Python list comprehension is and give a short example.",
    "Write a Python function that converts a temperature from Celsius to Fahrenheit.",
    "Write a Python function that checks whether a number is prime.",
    "What is the difference between a list and a tuple in Python?",
    "Write a Python function that counts how many times each word appears in a sentence and returns a dictionary.",
    'How do I sort a list of dictionaries by the value of the key "age" in Python?',
    "Write a Python function that returns the sum of all even numbers in a list.",
    "What does this Python code print? `print([x * 2 for x in range(4)])`",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "How do you handle a division by zero error in Python using try and except?",
    "Write a Python function that capitalizes the first letter of every word in a sentence.",
    "Write a Python function that returns True if two strings are anagrams of each other.",
    "Find the bug in this Python code and fix it: `def add(a, b): return a - b`",
    "Write a Python function that flattens a list of lists into a single list.",
    "How do I get today's date in Python and print it in the format YYYY-MM-DD?",
    "Write a Python function that returns the second smallest number in a list.",
    "Explain what the `self` parameter means in a Python class method.",
    "Write a Python class called Counter with methods to increment, decrement, and reset a count.",
    "Write a Python function that checks whether a year is a leap year.",
    "What does the Python `zip` function do? Give a small example.",
    "Write a Python function that returns the number of digits in a positive integer.",
    "Write a Python function that finds the most common character in a string.",
    "How do I save a dictionary to a JSON file in Python?",
    "Write a Python function that joins a list of strings into a single comma-separated string.",
    'What is the output of `len("hello world")` in Python, and why?',
    "Write a Python function that returns a new list with every element of the input list squared.",
    "Write a Python function that computes the greatest common divisor of two integers.",
    "Explain the difference between `==` and `is` in Python with an example.",
    "Write a Python function that uses binary search to find the index of a value in a sorted list.",
    "Write a Python generator that yields the square numbers 1, 4, 9, 16 and so on forever.",
    "Write a Python function that takes a string and returns it with all spaces removed.",
]

PASSAGES = [
    "The town library will close for two weeks in March to replace its old heating system. During the "
    "closure, members can return books at the community center, and the online catalog will remain "
    "available for e-book loans.",
    "Maya started running last spring because she wanted more energy. At first she could only jog for "
    "five minutes, but after three months of steady practice she finished her first ten-kilometer race.",
    "Honeybees share the location of flowers through a movement called the waggle dance. The angle of "
    "the dance shows the direction of the food, and the length of the waggle tells other bees how far away it is.",
    "A small bakery on Elm Street has begun donating its unsold bread to a local shelter every evening. "
    "The owner says the idea came from a customer, and the shelter now serves fresh bread six days a week.",
    "Many people think goldfish have a memory of only three seconds. In fact, goldfish can remember things "
    "for months, and they can even be trained to respond to sounds and colors.",
    "The city council voted to add protected bike lanes on three main roads next year. Supporters say the "
    "lanes will make cycling safer, while some shop owners worry about losing parking spaces.",
    "After years of decline, the number of sea otters along the coast has started to grow again. Scientists "
    "credit stricter hunting laws and cleaner water, and they hope the otters will help restore kelp forests.",
    "Our team tested two versions of the signup page. The version with a shorter form had thirty percent "
    "more signups, so we will show the shorter form to all new visitors starting next month.",
    "Tea was first drunk in China thousands of years ago. It later spread along trade routes to Japan, "
    "India, and Europe, where it became a daily habit and an important part of many cultures.",
    "The school science fair had more entries than ever this year. Projects ranged from homemade water "
    "filters to a robot that sorts recycling, and the winning team built a solar oven from a pizza box.",
    "Regular stretching can improve flexibility, reduce muscle tension, and lower the risk of injury. "
    "Experts suggest stretching gently after a short warm-up and holding each stretch for about twenty seconds.",
    "A storm knocked down power lines across the valley on Tuesday night. Repair crews worked through the "
    "night, and by Wednesday afternoon electricity had been restored to almost every home.",
    "The new phone has a larger battery and a brighter screen than last year's model, but it also costs "
    "one hundred dollars more. Reviewers say the upgrade is worth it only for people with much older phones.",
    "Octopuses are known for their intelligence. They can open jars, escape from tanks, and use coconut "
    "shells as shelters. Each of their eight arms contains many nerve cells, so the arms can react on their own.",
    "The museum's new exhibit shows everyday objects from one hundred years ago, including radios, toys, "
    "and kitchen tools. Visitors may handle some items, and children get a worksheet to compare old and new.",
    "Paul wanted to learn the guitar but kept giving up. This year he practiced for just ten minutes every "
    "day instead of long weekend sessions, and after six months he can play his favorite songs.",
    "Deserts are not always hot. The Gobi Desert in Asia has freezing winters, and Antarctica is considered "
    "the largest desert on Earth because it receives very little rain or snow each year.",
    "The company will try a four-day work week for six months. Employees will work the same number of "
    "hours, and managers will measure whether productivity and happiness improve during the trial.",
    "Composting turns food scraps and garden waste into rich soil. It reduces the amount of trash sent to "
    "landfills, and gardeners use the finished compost to help their plants grow stronger.",
    "The hiking trail to Eagle Point has reopened after repairs to a damaged bridge. Rangers remind "
    "visitors to stay on the marked path, carry enough water, and start early to avoid the afternoon heat.",
    "Elephants have excellent memories and strong family bonds. A herd is usually led by the oldest "
    "female, who remembers where to find water during dry seasons and guides the group to safety.",
    "Our neighborhood held its first cleanup day on Saturday. About fifty volunteers collected more than "
    "two hundred bags of litter from the park and the riverbank, and a local cafe gave everyone a free lunch.",
    "The printing press, invented in the fifteenth century, made books much cheaper to produce. As a "
    "result, more people learned to read, and new ideas spread quickly across Europe.",
    "Drinking enough water helps the body control its temperature, protect its joints, and remove waste. "
    "Thirst is a good guide for most people, but we need more water in hot weather and during exercise.",
    "The orchestra announced that its summer concerts will be held outdoors in the city park. Tickets are "
    "free, but seating is limited, so the organizers recommend bringing a blanket and arriving early.",
    "Lina moved to a new country without knowing the language. She joined a weekly conversation group and "
    "watched local TV with subtitles, and after a year she could chat comfortably with her neighbors.",
    "Penguins cannot fly, but they are excellent swimmers. Their wings have evolved into flippers, and "
    "some species can dive more than five hundred meters deep to catch fish and squid.",
    "The software update fixes a bug that made the app crash when uploading large photos. It also adds a "
    "dark mode and makes the search feature faster on older devices.",
    "Farmers in the region have started planting cover crops during the winter. These crops protect the "
    "soil from erosion, add nutrients, and reduce the need for chemical fertilizers in the spring.",
    "The first modern Olympic Games were held in Athens in 1896. Only a few hundred athletes took part, "
    "compared with more than ten thousand athletes from about two hundred countries in recent Games.",
    "Volunteers at the animal shelter walk dogs, clean cages, and help at adoption events. The shelter "
    "says that thanks to the volunteers, the number of adoptions doubled in the past year.",
    "Sleep plays an important role in memory. While we sleep, the brain sorts and stores information from "
    "the day, which is why a good night's rest helps students remember what they studied.",
    "The bridge across the river will be closed for repairs from June to August. Drivers should use the "
    "northern bridge, and an extra ferry will run every thirty minutes during rush hour.",
    "Coral reefs cover a tiny part of the ocean floor but are home to about a quarter of all marine "
    "species. Rising water temperatures cause coral bleaching, which can kill large areas of reef.",
    "Jonas built a small vegetable garden on his apartment balcony. With pots and a simple watering "
    "system he grows tomatoes, herbs, and lettuce, and in summer he rarely needs to buy salad.",
    "Chess was played in India around the sixth century under a different name. The game spread to "
    "Persia and then to Europe, and its rules slowly changed into the version played today.",
    "A cafe now gives a discount to customers who bring their own cups. In the first month, the number "
    "of paper cups thrown away dropped by almost half, and the owner plans to expand the program.",
    "Bats are the only mammals that can truly fly. Many species use echolocation: they send out high "
    "sounds and listen for the echoes to find insects in complete darkness.",
    "The team missed its project deadline because two key members were ill and a supplier delivered "
    "parts late. The manager has set a new deadline for next Friday and added a weekly progress check.",
    "Cooking at home can save money and lead to healthier meals. Beginners can start with simple dishes "
    "like omelets, soups, and pasta, and add new recipes as their confidence grows.",
]

SUMMARY_INSTRUCTIONS = [
    "Summarize the following passage in one sentence.",
    "Give a short summary of this text.",
    "What is the main idea of the passage below?",
    "Summarize this paragraph in no more than 20 words.",
    "Write a one-line headline that summarizes this paragraph.",
]

REWRITING = [
    'Rewrite this sentence to sound more formal: "Hey, can you send me that report thing by tomorrow?"',
    'Make this message more polite: "Give me the keys now."',
    'Rewrite this sentence in plain, simple English: "The utilization of public transportation '
    'facilitates the reduction of urban congestion."',
    'Change this sentence from passive to active voice: "The cake was eaten by the children."',
    'Fix the grammar in this sentence: "Me and him goes to the store yesterday."',
    'Make this sentence shorter without losing its meaning: "Due to the fact that it was raining, we '
    'made the decision to stay inside the house."',
    'Rewrite this sentence so it sounds cheerful and excited: "The meeting has been moved to Friday."',
    'Rewrite this sentence as if a pirate were saying it: "We need to leave the harbor before the storm arrives."',
    'Rewrite this weather forecast for a five-year-old: "Precipitation is expected throughout the afternoon."',
    "Turn this casual note into a professional email sentence: \"Sorry, can't make the call, something came up.\"",
    'Rewrite this sentence in the past tense: "She walks to the market and buys fresh bread."',
    'Paraphrase this sentence using different words: "The movie was so boring that I fell asleep halfway through."',
    'Make this product description more exciting: "This backpack has two pockets and is blue."',
    'Rewrite this complaint so it is calm and constructive: "Your app is terrible and it never works!"',
    'Rewrite this sentence in the future tense: "We planted trees along the river."',
    'Rewrite this sentence to be gender-neutral: "Every student must bring his own lunch."',
    'Combine these two sentences into one: "The dog was tired. It still wanted to play fetch."',
    'Rewrite this sentence as a short news headline: "A cat climbed to the top of the town clock tower '
    'and refused to come down."',
    'Make this sentence more vivid and descriptive: "The forest was quiet."',
    "Rewrite this sentence without the business jargon: \"Let's circle back and leverage our synergies going forward.\"",
    'Rewrite this statement as a question: "The train leaves at nine o\'clock."',
    'Change this sentence from active to passive voice: "The chef prepared a delicious meal."',
    'Rewrite this text message in full, correct English: "thx 4 the gift, c u l8r"',
    'Rewrite this sentence in a sad tone: "The summer holidays are over and school starts tomorrow."',
    'Make this sentence sound more confident: "I think maybe I could possibly help with the project."',
    'Rewrite this sentence as the opening of a fairy tale: "A farmer lived near the mountains with his three goats."',
    'Make this sentence more concise: "In my personal opinion, I believe that we should probably start '
    'the meeting now."',
    'Rewrite this sentence in reported speech: She said, "I am learning to play the piano."',
    'Make this job posting sound friendlier: "Applicants must have three years of experience. Late '
    'applications will be ignored."',
    'Rewrite this sentence using simpler words: "The physician recommended that the patient abstain from '
    'consuming sugary beverages."',
    'Rewrite this question as if a character from an old Shakespeare play were asking it: "Why are you late again?"',
    'Correct the spelling mistakes in this sentence: "I recieved the pakage on wensday."',
    'Rewrite this hotel review so it sounds balanced instead of angry: "The hotel was a disaster, the '
    'room was tiny and the staff were useless."',
    'Turn this command into a polite request: "Close the window."',
    'Rewrite this sentence in the first person: "He wakes up early and goes for a run before work."',
    'Rewrite this sentence for a formal business report: "Sales went way up this year, which is awesome."',
    'Make this sentence sound mysterious: "There is an old house at the end of the street."',
    "Rewrite these cooking instructions as a numbered list of steps: First boil the water, then add the "
    "pasta, cook it for ten minutes, and drain it.",
    'Rewrite this sentence so it speaks directly to the reader: "Students should check their answers '
    'before handing in the test."',
    'Make this apology sound more sincere: "Sorry about the mess."',
]

CREATIVE_TEMPLATES = [
    "Write a short poem about {}.",
    "Write a haiku about {}.",
    "Write a very short story, under 100 words, about {}.",
    "Write a four-line rhyming poem about {}.",
    "Write a funny limerick about {}.",
    "Write the opening paragraph of a story about {}.",
    "Write a short bedtime story for a young child about {}.",
    "Write a short, vivid description of {}.",
]

CREATIVE_SUBJECTS = [
    "the first snowfall of winter", "a cat who is afraid of mice", "a lighthouse on a stormy night",
    "an old bicycle in a garage", "a robot learning to paint", "the smell of rain on a summer evening",
    "a dragon who loves to bake bread", "the last day of summer vacation", "a lost umbrella",
    "a friendship between a fox and a crow", "the moon watching over a sleeping city",
    "a child planting her first seed", "a train journey through the mountains",
    "an astronaut looking back at Earth", "a busy morning at a fish market",
    "a snowman who wants to see the spring", "a grandfather's old pocket watch",
    "a tiny island with a single tree", "a dog waiting for its owner by the door",
    "autumn leaves dancing in the wind", "a secret door in a library", "a baker who wakes up before sunrise",
    "the ocean at dawn", "a shy giant who lives in the hills", "a paper boat floating down a stream",
    "a city after a thunderstorm", "a kite that escapes into the sky", "a penguin who wants to fly",
    "the first day at a new school", "a quiet cup of coffee on a rainy morning", "a turtle racing a snail",
    "a forgotten toy under the bed", "a star that falls into a farmer's field",
    "the sound of a piano in an empty house", "a mouse who becomes a famous chef", "a garden at midnight",
    "an owl who cannot stay awake at night", "two strangers sharing an umbrella",
    "a mountain that dreams of the sea", "a small cloud that wants to become rain",
]

ADVICE = [
    "How can I fall asleep faster at night?",
    "What are some good ways to stay focused while studying at home?",
    "How do I start running if I have never exercised before?",
    "Give me some tips for making a good first impression at a job interview.",
    "How can I save money on groceries each month?",
    "What should I do if I feel nervous before giving a presentation?",
    "How do I keep my houseplants alive when I often forget to water them?",
    "What are some simple ways to relax after a long and stressful day?",
    "How can I learn a new language on my own?",
    "How do I politely say no when a friend asks for a favor I cannot do?",
    "What is a good way to organize my desk so I can work better?",
    "How can I make new friends after moving to a new city?",
    "Give me tips for writing a clear and friendly email.",
    "How do I clean a cast iron pan without damaging it?",
    "What can I do to remember to drink more water during the day?",
    "How should I prepare for a long hike in the mountains?",
    "How can I spend less time scrolling on my phone?",
    "What are some healthy breakfast ideas that take less than ten minutes?",
    "How do I make a simple monthly budget?",
    "What should I pack for a weekend camping trip?",
    "How can I help my child enjoy reading books?",
    "How do I remove a coffee stain from a white shirt?",
    "What is a good routine for a productive morning?",
    "How can I become a better listener?",
    "How do I start a small vegetable garden in my backyard?",
    "What should I do if my computer is running slowly?",
    "How can I keep a conversation going with someone I just met?",
    "Give me advice on how to choose a strong password that I can remember.",
    "How can I stay motivated to exercise during the winter?",
    "How do I ask my manager for feedback on my work?",
    "What are some ways to make a small apartment feel bigger?",
    "How should I spend the evening before an important exam?",
    "How can I reduce the amount of plastic I use at home?",
    "What can I do to stop procrastinating on a big project?",
    "How do I teach my puppy to sit?",
    "How can I eat more vegetables if I don't like the taste of most of them?",
    "What are some good habits for keeping my personal finances healthy?",
    "How do I handle a disagreement with a roommate calmly?",
    "How can I improve my handwriting as an adult?",
    "What should I check before buying a used car?",
]

COMPARISON = [
    "Compare cats and dogs as pets.",
    "What is the difference between weather and climate?",
    "What are the pros and cons of renting a home compared with buying one?",
    "What is the difference between a virus and a bacterium?",
    "Compare tea and coffee in terms of taste, caffeine, and health effects.",
    "Is it better to read paper books or e-books? Give arguments for both sides.",
    "What are the advantages of cycling to work instead of driving?",
    "How is a lake different from a sea?",
    "Compare Python and JavaScript for someone learning to program.",
    "How can you tell a crocodile from an alligator?",
    "What are the pros and cons of studying alone versus studying in a group?",
    "Compare solar power and wind power as sources of energy.",
    "What is the difference between a hurricane and a tornado?",
    "For a 500-kilometer trip, is it better to take the train or fly? Compare the two.",
    "What is the difference between a credit card and a debit card?",
    "How are frogs and toads similar, and how are they different?",
    "Compare working from home with working in an office.",
    "What is the difference between a simile and a metaphor? Give an example of each.",
    "Compare baking and frying as ways of cooking food.",
    "How do the Sun and the Moon differ?",
    "What is the difference between a novel and a short story?",
    "What are the advantages and disadvantages of living in a city compared with the countryside?",
    "What is the difference between a list and a dictionary in Python?",
    "Compare butter and olive oil for everyday cooking.",
    "When is an email better than a phone call, and when is a phone call better?",
    "What is the difference between a planet and a star?",
    "How are rabbits and hares different from each other?",
    "What is the difference between a job and a career?",
    "Compare a democracy and a monarchy in a few sentences.",
    "Which is better for overall fitness, running or swimming? Compare them.",
    "How does a violin differ from a cello?",
    "What is the difference between an ocean and a river?",
    "Compare public transport and driving a car for getting around a big city.",
    "What are the main differences between a museum and a library?",
    "Mountains or beaches: compare them as vacation destinations.",
    "Compare paper maps with navigation apps on a phone.",
    "What is the difference between an introvert and an extrovert?",
    "Compare a digital camera with a smartphone camera for taking holiday photos.",
    "What is the difference between a fruit and a vegetable?",
    "Compare learning to play the piano with learning to play the guitar.",
]

SENTIMENT_TEMPLATES = [
    'Classify the sentiment of this sentence as positive, negative, or neutral: "{}"',
    'Is the following review positive or negative? "{}"',
    'What is the sentiment of this text? Answer with one word. "{}"',
    'Is this customer comment positive, negative, or neutral? Explain why in one sentence. "{}"',
]

SENTIMENT_SENTENCES = [
    "The food arrived cold and the waiter ignored us all evening.",
    "I loved every minute of this movie and would happily watch it again.",
    "The package was delivered on Tuesday.",
    "This blender is loud, but it makes the smoothest smoothies I have ever had.",
    "Honestly, the hotel room was cleaner than the photos suggested.",
    "I waited forty minutes on the phone and nobody helped me.",
    "The meeting starts at ten and will last about an hour.",
    "What a fantastic concert, the band was full of energy!",
    "The shoes looked nice but fell apart after two weeks.",
    "Our new neighbors brought us a homemade pie to say hello.",
    "The book was fine, nothing special, but not bad either.",
    "I can't believe how easy it was to set up this printer.",
    "The train was delayed again, and I missed my appointment.",
    "This app has changed the way I plan my week, and I love it.",
    "The store opens at nine on weekdays.",
    "The soup was far too salty to eat.",
    "My kids could not stop laughing during the puppet show.",
    "The instructions were confusing and two screws were missing.",
    "The view from the top of the hill was absolutely breathtaking.",
    "The software update changed the color of the icons.",
    "I regret buying this jacket; it is not warm at all.",
    "The staff went out of their way to make my birthday special.",
    "The battery lasts about six hours on a full charge.",
    "Terrible customer service, and the refund still hasn't arrived.",
]

TOPIC_TEMPLATES = [
    'Which category best fits this headline: sports, politics, science, business, or entertainment? "{}"',
    'Classify this news headline by topic and explain your choice briefly: "{}"',
]

HEADLINES = [
    "Local team wins championship after dramatic overtime goal",
    "Scientists discover a new species of frog in the rainforest",
    "Parliament passes new law on school funding",
    "Tech company reports record profits in third quarter",
    "Popular singer announces world tour for next summer",
    "Astronomers spot water vapor on a distant planet",
    "City marathon attracts twenty thousand runners",
    "Coffee prices rise as harvest falls short",
]

SPAM_MESSAGES = [
    "Congratulations! You have won a free cruise. Click this link now to claim your prize.",
    "Hi Anna, the team lunch is moved to 1 pm tomorrow. See you there.",
    "URGENT: your account will be closed today unless you confirm your password here.",
    "Reminder: your dentist appointment is on Monday at 3:30 pm.",
]

FACT_OR_OPINION = [
    "Water boils at 100 degrees Celsius at sea level.",
    "Pizza is the best food in the world.",
    "The Pacific is the largest ocean on Earth.",
    "Summer is the most enjoyable season of the year.",
]

LISTS = [
    "List five fruits that are high in vitamin C.",
    "Name three countries in South America and their capitals.",
    "Give me a list of seven healthy snacks to take to work.",
    "List five things to check before going on a long car trip.",
    "Name the four planets in our solar system that are larger than Earth.",
    "List six indoor activities for a rainy day.",
    "Give five ideas for a child's birthday party theme.",
    "List the seven continents from largest to smallest.",
    "Name five musical instruments that belong to the string family.",
    "List five ways to save energy at home.",
    "Give me a list of ten common English verbs.",
    "List the five basic tastes the human tongue can detect.",
    "Name five animals that live in the Arctic.",
    "List five questions to ask at the end of a job interview.",
    "Give me six name ideas for a friendly golden retriever.",
    "List five kitchen tools every beginner cook should have.",
    "Name three famous paintings and the artists who painted them.",
    "List five hobbies that cost little or no money.",
    "Give me a list of eight vegetables that grow well in containers.",
    'List four ways to say "thank you" in different languages.',
    "Name five sports that are played with a ball.",
    "List six things to bring for a day at the beach.",
    "Give five ideas for a quick weeknight dinner.",
    "List the days of the week in French.",
    "Name five board games that families can play together.",
    "List five signs that a houseplant needs more water.",
    "Give me a list of five classic novels worth reading.",
    "List four renewable sources of energy.",
    "Name six animals that are active mainly at night.",
    "List five tips for taking better photos with a phone.",
    'Give me seven words that rhyme with "light".',
    "List five jobs that involve working outdoors.",
    "Name the four seasons and one typical activity for each.",
    "List five items that belong in a basic first aid kit.",
    "Give me five conversation starters for a party where I don't know anyone.",
    "List the first ten prime numbers.",
    "Name five birds that cannot fly.",
    "List five creative ways to reuse empty glass jars.",
    "Give me a list of six adjectives that describe the ocean.",
    "List five simple exercises that can be done at home without equipment.",
]

FACTUAL = [
    "What is the capital city of Japan?",
    "How many legs does a spider have?",
    "Who wrote the play Romeo and Juliet?",
    "What is the largest planet in our solar system?",
    "At what temperature in degrees Celsius does water freeze?",
    "What is the chemical symbol for the element gold?",
    "Which is the longest river in Africa?",
    "How many continents are there on Earth, and what are they called?",
    "Who painted the Mona Lisa?",
    "Which gas do plants take in from the air to make their food?",
    "What is the tallest mountain in the world above sea level?",
    "How many days are there in a leap year?",
    "What language do most people in Brazil speak?",
    "Who was the first person to walk on the Moon, and in what year?",
    "What is the boiling point of water at sea level in degrees Fahrenheit?",
    "Which planet is known as the Red Planet, and why?",
    "What is the largest mammal on Earth?",
    "What is the currency of the United Kingdom?",
    "How many sides does a hexagon have?",
    "In which country are the pyramids of Giza located?",
    "What is the hardest natural substance on Earth?",
    "Which scientist developed the theory of relativity?",
    "What is the main ingredient in guacamole?",
    "How many players does a soccer team have on the field at one time?",
    "What is the smallest prime number?",
    "What is the capital city of Australia?",
    "Which organ pumps blood through the human body?",
    "What are the three primary colors in traditional painting?",
    "How many hours are there in one week?",
    "Which animal is often called the king of the jungle?",
    "What is the longest river in South America?",
    "Who is usually credited with inventing the telephone?",
    "What is the name of the galaxy that contains our solar system?",
    "Which musical instrument usually has 88 keys?",
    "What is the common name for the chemical compound H2O?",
    "In what year did the Second World War end?",
    "What is the largest hot desert in the world?",
    "How many strings does a standard acoustic guitar have?",
    "Which planet is closest to the Sun?",
    "What is the capital city of Canada?",
]

TRANSLATION_TEMPLATES = [
    'Translate into French: "{}"',
    'Translate this sentence into Spanish: "{}"',
    'How would you say this in French? "{}"',
    'Translate the following English sentence to Spanish: "{}"',
]

TRANSLATION_SENTENCES = [
    "Good morning, how are you today?", "Where is the train station?",
    "I would like a cup of coffee, please.", "My brother lives in a small house near the sea.",
    "The weather is very nice today.", "Can you help me find my keys?",
    "We are going to the beach on Saturday.", "I have two cats and one dog.",
    "What time does the museum open?", "She is reading a book in the garden.",
    "Thank you very much for your help.", "The children are playing in the park.",
    "I am learning to cook.", "How much does this jacket cost?",
    "It is raining, so take an umbrella.", "My favorite color is green.",
    "The restaurant is closed on Mondays.", "I don't understand, can you repeat that?",
    "We ate dinner with our friends last night.", "The library is next to the bank.",
    "Happy birthday, I hope you have a wonderful day.", "I need to buy bread and milk.",
    "Our teacher is very kind.", "The cat is sleeping on the sofa.",
    "Please close the door when you leave.", "I live in a big city.",
    "Do you speak English?", "Tomorrow I will visit my grandmother.",
    "The water in the lake is cold.", "He plays football every Sunday.",
    "Where can I buy a ticket?", "I am very tired after work.",
    "The flowers in the garden are beautiful.", "My phone is on the kitchen table.",
    "Let's meet at the cafe at noon.", "I like to walk in the morning.",
    "The hotel room has a view of the mountains.", "What is your name?",
    "We need more time to finish the project.", "The bus is late again.",
]

REASONING = [
    "If all bloops are razzies and all razzies are lazzies, are all bloops definitely lazzies? Explain.",
    "What number comes next in the sequence 2, 4, 8, 16, ...? Explain the pattern.",
    "Anna is taller than Ben, and Ben is taller than Carl. Who is the shortest of the three?",
    "A farmer has 10 sheep. All but 4 run away. How many sheep does the farmer have left?",
    "If today is Wednesday, what day of the week will it be in 10 days?",
    "Some cats are black. Tom is a cat. Can we conclude that Tom is black? Explain your reasoning.",
    "Which word does not belong in this group: apple, banana, carrot, cherry? Explain why.",
    "What letter comes next in the series A, C, E, G, ...?",
    "Three boxes are labeled apples, oranges, and mixed, but every label is wrong. You may take one fruit "
    "from one box. Which box should you pick from to fix all the labels?",
    "If 5 machines make 5 toys in 5 minutes, how long do 100 machines need to make 100 toys?",
    "Lisa's mother has three children: April, May, and one more. What is the third child's name?",
    "Complete the analogy and explain it: hand is to glove as foot is to what?",
    "Mike is older than Sara, and Sara is older than Jon. Is Jon older than Mike?",
    "A red house is made of red bricks and a blue house is made of blue bricks. What is a greenhouse made of?",
    "What is the next number in the sequence 1, 1, 2, 3, 5, 8, ...?",
    "A clock shows exactly 3:00. What is the angle between the hour hand and the minute hand?",
    "Four friends sit in a row. Dana sits to the left of Eli, Eli sits to the left of Fay, and Gus sits "
    "on the far right. Who sits on the far left?",
    "No fish can walk, and a salmon is a fish. Can a salmon walk? Explain.",
    "A bat and a ball cost 1.10 dollars in total. The bat costs 1 dollar more than the ball. "
    "How much does the ball cost?",
    "You are running a race and you pass the person in second place. What place are you in now?",
    "Which is heavier: a kilogram of feathers or a kilogram of iron?",
    "All squares are rectangles. Does that mean all rectangles are squares? Explain.",
    "What shape comes next in the pattern: circle, square, circle, square, circle, ...?",
    "Tim has more marbles than Sue but fewer than Ray. Who has the most marbles?",
    "A snail climbs 3 meters up a wall each day and slides down 2 meters each night. The wall is "
    "10 meters tall. On which day does the snail reach the top?",
    'In a secret code, "CAT" is written as "DBU". How would "DOG" be written in the same code?',
    "A box contains only red and blue balls, 15 in total. There are 5 more red balls than blue balls. "
    "How many blue balls are there?",
    'Is this argument valid? "If it rains, the ground gets wet. The ground is wet. Therefore, it rained." Explain.',
    "Which number is the odd one out: 3, 5, 7, 9, 11? Explain your answer.",
    "A father is 30 years older than his son. In 5 years, the father will be twice as old as the son. "
    "How old is the son now?",
    'Rearrange the letters of the word "LISTEN" to make a word that means making no sound.',
    "Three people each shake hands with each other exactly once. How many handshakes are there in total?",
    "If yesterday was Friday, what day will it be the day after tomorrow?",
    "You have a 3-liter jug and a 5-liter jug and plenty of water. How can you measure exactly 4 liters?",
    "All of Kim's pets are dogs except two, all are cats except two, and all are parrots except two. "
    "How many pets does Kim have?",
    "What is the missing number in the sequence 3, 6, 9, __, 15?",
    "Every student in the chess club plays chess. Maya does not play chess. Is Maya in the chess club?",
    "A shop is open every day except Sunday. If the shop is closed today, what day is tomorrow?",
    "How many times does the digit 1 appear when you write all the numbers from 1 to 20?",
    "A rope ladder hangs over the side of a ship, its bottom rung touching the water. The tide rises by "
    "one meter. How many rungs are now under water? Explain.",
]

FORMAT_QUESTIONS = [
    "What are the benefits of regular exercise?", "Why should people learn a second language?",
    "What makes a good teacher?", "How can cities reduce traffic jams?",
    "Why is sleep important for students?", "What should someone know before adopting a dog?",
    "How can a small business attract new customers?", "What are the advantages of reading every day?",
    "Why are bees important for farming?", "How can people reduce food waste at home?",
    "What makes a story exciting to read?", "Why is it useful to know how to cook?",
    "What are good habits for healthy teeth?", "How can a team work well together?",
    "Why do people enjoy traveling?", "What are the main causes of air pollution?",
    "How can someone get ready for a job interview?", "What are the benefits of walking to work?",
    "Why is recycling important?", "What makes a city a nice place to live?",
    "How can students manage their time better?", "What are the dangers of too much screen time?",
    "Why is it important to drink enough water?", "How do trees help the environment?",
    "What are some good ways to celebrate a friend's success?",
    "What are the benefits of playing a musical instrument?", "Why should children spend time outdoors?",
    "How can a person become more patient?", "What makes a password hard to guess?",
    "Why do people keep pets?", "Why is it worth learning math at school?",
    "How can someone make a small garden look beautiful?", "Why are museums valuable to a community?",
    "What should a good breakfast include?", "How can people stay safe while swimming?",
    "What are the advantages of public libraries?", "Why is teamwork important in sports?",
    "How can a person be kind to strangers?", "What makes a holiday relaxing?",
    "Why is it good to volunteer?",
]

FORMATS = [
    "Answer in exactly three bullet points.",
    "Answer in one sentence.",
    "Reply with a numbered list of exactly four items.",
    "Answer in exactly two sentences.",
    "Keep your answer under 30 words.",
    "Write your whole answer in lowercase letters.",
    'Reply only with JSON of the form {"points": [...]}, listing three short points.',
    "Give exactly two points, each on its own line starting with a dash.",
]

WRITING = [
    "Write a short email to your manager asking for next Friday off.",
    "Write a thank-you note to a neighbor who watered your plants while you were away.",
    "Write a text message inviting a friend to dinner on Saturday.",
    "Write a short email to a teacher explaining that your child will miss school tomorrow because of a "
    "doctor's appointment.",
    "Write a polite message to your landlord asking them to fix a leaking kitchen tap.",
    "Write a short birthday message for a coworker.",
    "Write a two-sentence product description for a reusable water bottle.",
    "Write a short welcome message for new members of a hiking club.",
    "Write the opening paragraph of a cover letter for a job as a library assistant.",
    "Write a friendly reminder to your team that the monthly reports are due on Thursday.",
    "Write a short apology email to a customer whose order arrived late.",
    "Write a social media post announcing that a small bakery opens next week.",
    "Write a short toast to congratulate a friend at their wedding.",
    "Write a note for a shared office fridge asking people to label their food.",
    "Write a short review of a fictional restaurant that serves excellent pasta.",
    "Write an out-of-office reply for someone who is on vacation until Monday.",
    "Write a short message to a friend who is feeling sad after failing an exam.",
    "Write a one-paragraph bio for a freelance graphic designer named Sam.",
    "Write an email asking a colleague to move a meeting to Wednesday afternoon.",
    "Write a short letter to your future self, to be opened in ten years.",
    "Write the text for a poster about a lost cat named Pepper.",
    "Write a brief invitation to a school bake sale.",
    "Write a message that politely declines an invitation to a party.",
    "Write a short thank-you email to send after a job interview.",
    "Write a short announcement that the office will be closed on a public holiday.",
    "Write a short note to a delivery driver explaining where to leave a package.",
    "Write a catchy slogan for a bicycle repair shop.",
    "Write a short message to welcome a new student to the class.",
    "Write a short complaint email about a washing machine that arrived broken.",
    "Write a short recommendation for a former coworker who is great at solving problems.",
    "Write a postcard message from a holiday at the seaside.",
    "Write a short introduction to say at the start of a meeting with a new team.",
    "Write a polite message asking your neighbors to keep the noise down after 10 pm.",
    "Write a short newsletter paragraph about a community garden's first harvest.",
    "Write a short note to thank a bus driver who helped you find your lost wallet.",
    "Write a short message to a client confirming a meeting at 2 pm on Tuesday.",
    "Write an email to a hotel asking whether guests may bring a small dog.",
    "Write a short get-well-soon message for a friend in hospital.",
    "Write a short sign for a lost-and-found box at the gym.",
    "Write a short farewell message for a colleague who is retiring.",
]


def _turn(i: int, n: int) -> int:
    """Template index for item ``i`` of ``n`` templates; it skips one every ten items so the
    held-out items (every 10th) do not all land on the same few templates."""
    return (i + i // HELDOUT_EVERY) % n


def _cycle(templates: list[str], items: list[str]) -> list[str]:
    """Each item placed into the next template in turn."""
    return [templates[_turn(i, len(templates))].format(item) for i, item in enumerate(items)]


def _summaries() -> list[str]:
    n = len(SUMMARY_INSTRUCTIONS)
    return [f"{SUMMARY_INSTRUCTIONS[_turn(i, n)]}\n\n{p}" for i, p in enumerate(PASSAGES)]


def _classification() -> list[str]:
    return (
        _cycle(SENTIMENT_TEMPLATES, SENTIMENT_SENTENCES)
        + _cycle(TOPIC_TEMPLATES, HEADLINES)
        + [f'Is this message spam or not spam? Explain briefly. "{m}"' for m in SPAM_MESSAGES]
        + [f'Is this statement a fact or an opinion? "{s}"' for s in FACT_OR_OPINION]
    )


def _formatting() -> list[str]:
    return [f"{q} {FORMATS[_turn(i, len(FORMATS))]}" for i, q in enumerate(FORMAT_QUESTIONS)]


CATEGORIES: dict[str, list[str]] = {
    "explanation": EXPLANATION,
    "math": MATH,
    "coding": CODING,
    "summarization": _summaries(),
    "rewriting": REWRITING,
    "creative": _cycle(CREATIVE_TEMPLATES, CREATIVE_SUBJECTS),
    "advice": ADVICE,
    "comparison": COMPARISON,
    "classification": _classification(),
    "list": LISTS,
    "factual": FACTUAL,
    "translation": _cycle(TRANSLATION_TEMPLATES, TRANSLATION_SENTENCES),
    "reasoning": REASONING,
    "formatting": _formatting(),
    "writing": WRITING,
}


def records() -> list[dict[str, str]]:
    """All prompts with stable ids; every ``HELDOUT_EVERY``-th of each category held out."""
    out, seen = [], set()
    for category, prompts in CATEGORIES.items():
        for i, text in enumerate(prompts):
            key = " ".join(text.lower().split())
            if key in seen:
                raise ValueError(f"duplicate prompt in {category}: {text!r}")
            seen.add(key)
            split = "heldout" if i % HELDOUT_EVERY == HELDOUT_EVERY - 1 else "train"
            out.append({"id": f"p{len(out) + 1:04d}", "prompt": text, "category": category, "split": split})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(__file__).resolve().parents[1] / "megatron_rlhf" / "data" / "prompts.jsonl"
    p.add_argument("--output", type=Path, default=default, help="jsonl file to write")
    args = p.parse_args(argv)
    rows = records()
    with args.output.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    heldout = sum(r["split"] == "heldout" for r in rows)
    print(f"wrote {len(rows)} prompts ({heldout} held out, {len(CATEGORIES)} categories) to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
